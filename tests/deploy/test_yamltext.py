"""The dependency-free YAML writer: what a YAML reader reads back is what was written."""

from __future__ import annotations

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.deploy.yamltext import dump, dump_all

scalars = st.one_of(
    st.text(max_size=30),
    st.sampled_from(
        ["true", "No", "null", "~", "1.5", "0x1f", "- a", "a: b", "a:", "#x", "=", "<<"]
    ),
    st.sampled_from(["line\n", "a\nb\n", "a\n\nb\n", "a\n  b\n", "x\n \n", "é\nß\n", "\ta\n"]),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.booleans(),
)
trees = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=12), trees, max_size=5))
def test_round_trip(document):
    assert yaml.safe_load(dump(document)) == (document or None)


def test_stream_of_documents_with_a_header():
    text = dump_all([{"a": 1}, {"b": ["x", {"c": "d"}]}], header=["one", "two"])
    assert text.startswith("# one\n# two\n---\n")
    assert list(yaml.safe_load_all(text)) == [{"a": 1}, {"b": ["x", {"c": "d"}]}]


def test_profile_text_is_a_literal_block():
    text = dump({"data": {"profile.toml": '[run]\nname = "x"\n'}})
    assert text == 'data:\n  profile.toml: |\n    [run]\n    name = "x"\n'
