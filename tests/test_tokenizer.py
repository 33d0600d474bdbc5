"""ByteTokenizer: byte round trips, UTF-8 text, special tokens and input validation."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.tokenizer import (
    BOS_ID,
    BYTE_TOKENIZER,
    BYTE_VOCAB,
    EOS_ID,
    MASK_ID,
    PAD_ID,
    SPECIAL_IDS,
    VOCAB_SIZE,
    ByteTokenizer,
)

T = BYTE_TOKENIZER


def test_constants_and_properties():
    assert (BYTE_VOCAB, BOS_ID, EOS_ID, MASK_ID, PAD_ID, VOCAB_SIZE) == (256, 256, 257, 258, 259, 260)
    assert SPECIAL_IDS == {"bos": 256, "eos": 257, "mask": 258, "pad": 259}
    assert (T.vocab_size, T.bos_id, T.eos_id, T.mask_id, T.pad_id) == (260, 256, 257, 258, 259)
    assert ByteTokenizer() == T and hash(ByteTokenizer()) == hash(T)
    with pytest.raises(AttributeError):
        T.vocab_size = 3


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.booleans(), st.booleans())
def test_bytes_round_trip(data, bos, eos):
    ids = T.encode(data, bos=bos, eos=eos)
    assert ids == [BOS_ID] * bos + list(data) + [EOS_ID] * eos
    assert all(type(i) is int for i in ids)
    arr = T.encode_np(data, bos=bos, eos=eos)
    assert arr.dtype == np.uint16 and arr.tolist() == ids
    assert T.decode_bytes(ids) == data
    assert T.decode_bytes(arr) == data
    assert T.encode(bytearray(data)) == T.encode(memoryview(data)) == list(data)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=100))
def test_text_round_trip(text):
    ids = T.encode(text, bos=True, eos=True)
    assert ids[1:-1] == list(text.encode("utf-8"))
    assert T.decode(ids) == text
    assert T.decode(ids, errors="strict") == text


def test_non_ascii_utf8():
    text = "héllo ∑ 日本 🐍"
    ids = T.encode(text)
    assert ids == list(text.encode("utf-8")) and len(ids) > len(text)
    assert max(ids) < BYTE_VOCAB
    assert T.decode(ids) == text
    # a truncated multi-byte sequence: replaced by default, strict raises
    cut = T.encode("🐍")[:2]
    assert T.decode(cut) == "\ufffd"
    assert T.decode(cut, errors="ignore") == ""
    with pytest.raises(UnicodeDecodeError):
        T.decode(cut, errors="strict")


def test_specials():
    ids = [BOS_ID, 104, 105, MASK_ID, PAD_ID, EOS_ID]
    assert T.decode_bytes(ids) == b"hi"
    assert T.decode(np.array(ids, np.int32)) == "hi"
    assert T.decode([]) == "" and T.decode_bytes(np.zeros(0, np.uint16)) == b""
    with pytest.raises(ValueError, match=r"special token id 256 \(bos\) at position 0"):
        T.decode_bytes(ids, skip_special=False)
    with pytest.raises(ValueError, match=r"258 \(mask\) at position 1"):
        T.decode([104, MASK_ID], skip_special=False)
    assert T.decode_bytes([104, 105], skip_special=False) == b"hi"


@pytest.mark.parametrize("bad", [-1, 260, 1000, 2**70])
def test_out_of_range_ids(bad):
    with pytest.raises(ValueError, match=rf"token id {bad} at position 1 is out of range.*\[0, 260\)"):
        T.decode_bytes([65, bad])


def test_bad_inputs():
    with pytest.raises(TypeError, match="text must be str"):
        T.encode(123)
    with pytest.raises(TypeError, match="text must be str"):
        T.encode_np(["a"])
    with pytest.raises(TypeError, match="bos must be a bool"):
        T.encode("a", bos=1)
    with pytest.raises(TypeError, match="eos must be a bool"):
        T.encode("a", eos="yes")
    with pytest.raises(TypeError, match="ids must"):
        T.decode("abc")
    with pytest.raises(TypeError, match="ids must"):
        T.decode_bytes(b"abc")
    with pytest.raises(TypeError, match="integer dtype"):
        T.decode_bytes(np.array([65.0]))
    with pytest.raises(TypeError, match="integer dtype"):
        T.decode_bytes([True, False])
    with pytest.raises(ValueError, match="1-D"):
        T.decode_bytes([[65]])
    with pytest.raises(TypeError, match="skip_special must be a bool"):
        T.decode_bytes([65], skip_special=None)
    with pytest.raises(ValueError, match="errors='nope' is not a registered"):
        T.decode([65], errors="nope")
    with pytest.raises(TypeError, match="errors must be a str"):
        T.decode([65], errors=None)
