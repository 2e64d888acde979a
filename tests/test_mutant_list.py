"""tests/mutants.py stays runnable: each entry's line still occurs exactly once in its file. An
edit that changes such a line makes the entry stale, and `make mutants` then refuses to run;
`make test` says so with the change that made it stale."""

import mutants


def test_every_hand_written_mutant_still_finds_its_line():
    assert mutants.check_entries(mutants.MUTANTS) == []
