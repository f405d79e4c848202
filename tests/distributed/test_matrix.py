"""The feature x layout table of docs/distributed.md is what the checks a run makes say, and
every test it names exists."""

import re
from pathlib import Path

import pytest

from kiln.distributed.matrix import PROOFS, table

pytest.importorskip("transformers")

ROOT = Path(__file__).parents[2]


def test_the_docs_table_is_the_checks_table():
    doc = (ROOT / "docs" / "distributed.md").read_text()
    found = re.search(r"<!-- matrix: .*? -->\n(.*?)<!-- /matrix -->", doc, re.S)
    assert found, "docs/distributed.md has no generated feature x layout table"
    assert found.group(1) == table(), (
        "regenerate the table: python -c 'from kiln.distributed.matrix import table; print(table())'"
    )


@pytest.mark.parametrize("proof", sorted(set(PROOFS.values())))
def test_each_cell_names_a_test_that_exists(proof):
    path, name = proof.split("::")
    assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), proof
