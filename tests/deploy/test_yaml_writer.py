"""The manifest writer (PyYAML with the renderer's options): what a YAML reader reads back
is what was written, and the text stays readable."""

from __future__ import annotations

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.deploy.k8s import dump_all

scalars = st.one_of(
    st.text(max_size=30),
    st.sampled_from(
        ["true", "No", "null", "~", "1.5", "0x1f", "- a", "a: b", "a:", "#x", "=", "<<", "1e3"]
    ),
    st.sampled_from(
        ["line\n", "a\nb\n", "a\n\nb\n", "a\n  b\n", "x\n \n", "é\nß\n", "\ta\n", "a\x85\nb\n"]
    ),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
)
trees = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.dictionaries(st.text(max_size=12), trees, max_size=5), max_size=3))
def test_round_trip(documents):
    assert list(yaml.safe_load_all(dump_all(documents))) == documents


def test_stream_of_documents_with_a_header():
    text = dump_all([{"a": 1}, {"b": ["x", {"c": "d"}]}], header=["one", "two"])
    assert text == "# one\n# two\n---\na: 1\n---\nb:\n  - x\n  - c: d\n"


def test_floats_and_none():
    assert dump_all([{"lr": 0.5, "tiny": 1e-30, "none": None}]) == (
        "---\nlr: 0.5\ntiny: 1.0e-30\nnone: null\n"
    )


def test_strings_a_reader_would_take_for_something_else_are_quoted():
    values = ["true", "no", "null", "1", "0.5", "29400", "[]", "a: b"]
    text = dump_all([{"v": values}])
    assert text == "---\nv:\n" + "".join(f'  - "{v}"\n' for v in values)


def test_keys_stay_in_the_order_built():
    assert dump_all([{"b": 1, "a": 2}]) == "---\nb: 1\na: 2\n"


def test_profile_text_is_a_literal_block():
    text = dump_all([{"data": {"profile.toml": '[run]\nname = "x"\n'}}])
    assert text == '---\ndata:\n  profile.toml: |\n    [run]\n    name = "x"\n'


def test_a_long_command_line_is_not_folded():
    word = "--pools.inference.devices=" + "x" * 200
    assert dump_all([{"command": [word]}]) == f"---\ncommand:\n  - {word}\n"
