"""The BLEU references on disk: a damaged file is set aside, named, and its references computed again."""

from __future__ import annotations

import logging

from bild_env.reference import ReferenceStore


def test_a_truncated_references_file_is_set_aside_and_rebuilt(make_env, caplog):
    env = make_env(max_new_tokens=8).unwrapped
    env.reset(options={"prompt_index": 0})
    path, reference = env.references.path, env.reference
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # cut short (a full disk, a copy killed half-way)
    with caplog.at_level(logging.WARNING, logger="bild_env.reference"):
        again = make_env(max_new_tokens=8).unwrapped  # was: 'bad environment option: Expecting value ...'
        again.reset(options={"prompt_index": 0})
    assert again.reference == reference  # computed again, the same greedy continuation
    asides = list(path.parent.glob(path.name + ".bad-*"))
    assert len(asides) == 1 and asides[0].read_text() == text[: len(text) // 2]
    assert str(path) in caplog.text and "moved aside to" in caplog.text and asides[0].name in caplog.text
    assert ReferenceStore(again.pair, 8).refs  # the rebuilt file reads


def test_a_references_file_of_another_shape_is_set_aside_too(tiny_pair, tmp_path, caplog):
    store = ReferenceStore(tiny_pair, 8, folder=tmp_path)
    store.path.write_text('["not", "a", "dict"]')
    with caplog.at_level(logging.WARNING, logger="bild_env.reference"):
        assert ReferenceStore(tiny_pair, 8, folder=tmp_path).refs == {}
    assert "not a JSON object of token lists" in caplog.text and not store.path.exists()


def test_references_no_greedy_decode_makes_are_computed_again(make_env, caplog):
    import json

    env = make_env(max_new_tokens=8).unwrapped
    env.reset(options={"prompt_index": 0})
    path, reference = env.references.path, env.reference
    (key,) = json.loads(path.read_text())
    for wrong in ([], [10**9] * len(reference), list(range(9)), [True, 1]):  # empty, out of the vocabulary, too long
        path.write_text(json.dumps({key: wrong}))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="bild_env.reference"):
            again = make_env(max_new_tokens=8).unwrapped
            again.reset(options={"prompt_index": 0})
        assert again.reference == reference, wrong  # the target's greedy continuation, not the stored one
        assert "computed again" in caplog.text and str(path) in caplog.text
        assert json.loads(path.read_text()) == {key: reference}
