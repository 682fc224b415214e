"""Running a ``python -m bench`` command that must be refused."""

import pytest

from bench.__main__ import main


def refused(argv: list[str], capsys) -> str:
    """Run the command; it must exit 2 with one ``error: …`` line and no traceback. Returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err
