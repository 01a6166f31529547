"""Cross-tokenizer alignment: one sharer token per receiver token."""

import pytest

from cachegraft_cli.errors import AlignmentError
from cachegraft_cli.lm.align import TokenAligner


@pytest.fixture(scope="module")
def toks(tiny_models):
    return tiny_models["receiver"].tokenizer, tiny_models["sharer_other"].tokenizer


def test_same_vocabulary_is_passthrough(tiny_models):
    tok = tiny_models["receiver"].tokenizer
    aligner = TokenAligner(tok, tiny_models["sharer_same"].tokenizer)
    assert aligner.identity and aligner.align([5, 9, 200]) == [5, 9, 200]


def test_one_sharer_token_per_receiver_token(toks):
    rt, st = toks
    ids = rt("Harbor town was founded in 1820 by émigré fishermen.", add_special_tokens=False)["input_ids"]
    out = TokenAligner(rt, st).align(ids)
    assert len(out) == len(ids) and all(0 <= i < len(st) for i in out)


def _multi_piece_token(rt, st):
    """A receiver token the sharer splits into pieces whose first is not the longest."""
    for rid in range(len(rt)):
        if rid in rt.all_special_ids:
            continue
        text = rt.decode([rid], clean_up_tokenization_spaces=False)
        pieces = st(text, add_special_tokens=False)["input_ids"]
        lens = [len(st.decode([p], clean_up_tokenization_spaces=False)) for p in pieces]
        if len(pieces) > 1 and max(lens) > lens[0]:
            return rid, pieces, lens
    pytest.fail("no multi-piece token in the tiny vocabularies")


def test_multi_piece_first_and_longest(toks):
    rt, st = toks
    rid, pieces, lens = _multi_piece_token(rt, st)
    assert TokenAligner(rt, st, "first").align([rid]) == [pieces[0]]
    assert TokenAligner(rt, st, "longest").align([rid]) == [pieces[lens.index(max(lens))]]


def test_special_tokens_map_by_role(toks):
    rt, st = toks
    aligner = TokenAligner(rt, st)
    assert aligner.align([rt.eos_token_id]) == [st.eos_token_id]
    # the sharer has no pad token: pad falls back to the sharer's eos
    assert aligner.align([rt.pad_token_id]) == [st.eos_token_id]


def test_empty_decoding_maps_to_unk(toks):
    rt, st = toks
    aligner = TokenAligner(rt, st)
    aligner._special.clear()  # force the text path for a token that decodes to nothing
    empty = next(i for i in rt.all_special_ids)
    rt_decode = rt.decode
    try:
        rt.decode = lambda ids, **kw: "" if ids == [empty] else rt_decode(ids, **kw)
        assert aligner.map_token(empty) == st.unk_token_id
    finally:
        rt.decode = rt_decode


def test_unknown_strategy(toks):
    with pytest.raises(AlignmentError):
        TokenAligner(*toks, strategy="middle")
