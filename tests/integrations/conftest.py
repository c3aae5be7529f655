"""The workspace every integration test shares: a tokenizer trained on the tests' own corpus and the data files,
made once per session, offline."""

import hf_stack
import pytest


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_stack")
    hf_stack.build_tokenizer(folder)
    hf_stack.write_data(folder)
    return folder
